"""The training text for the demo tokenizer, generated here so token ids never depend on outside files.

Everything is hand-written and combined by a seeded `random.Random` using only `choice`/`randrange`,
whose outputs for integer seeds have been stable across CPython versions since 3.2.
"""

from __future__ import annotations

import random

# A few hundred common English words: enough distinct pieces for ~1,800 BPE merges.
ENGLISH_WORDS = """
the be to of and a in that have it for not on with he as you do at this but his by from they we
say her she or an will my one all would there their what so up out if about who get which go me
when make can like time no just him know take people into year your good some could them see
other than then now look only come its over think also back after use two how our work first
well way even new want because any these give day most us is are was were been has had did
said made went saw took came found told asked seemed left felt called tried became kept began
model token server request response stream cache block batch queue prefix memory engine
schedule scheduler runner worker thread process event loop message prompt answer question
chat system user assistant tool function call result error value number string list dict
array tensor matrix vector layer weight bias norm attention head key query embedding vocab
decode encode generate sample logits probability temperature seed random greedy beam length
apple banana cherry orange lemon grape melon peach pear plum berry mango coconut tomato potato
water fire earth air light dark night morning evening summer winter spring autumn weather rain
snow wind cloud river mountain forest ocean island desert valley city village country world
house room door window table chair floor wall roof garden street road bridge station market
school teacher student book page letter word sentence story poem song music picture color
red green blue yellow black white brown purple pink gray silver golden bright quiet loud soft
happy sad angry calm brave kind clever simple strong weak fast slow early late young old small
large long short high low near far open close begin end start stop read write speak listen
walk run jump swim fly drive ride sleep wake eat drink cook clean build break fix move carry
hold push pull turn show hide find lose win play learn teach help need love hope wish believe
remember forget understand explain describe compare measure count change grow fall rise
hello world thanks please sorry yes maybe always never often sometimes today tomorrow yesterday
because although however therefore while until unless whether whose whom where why which
computer program software hardware network internet website browser keyboard screen mouse
file folder path directory config option setting default version release update install
python rust javascript linux kernel compiler library package module class method object
integer float boolean character byte bit signed unsigned pointer reference address offset
""".split()

CODE_TOKENS = """
def class return import from as if elif else for while in not and or is None True False
try except finally raise with lambda yield async await pass break continue self cls
print len range enumerate zip dict list set tuple str int float bool isinstance
fn let mut pub struct enum impl trait match Some Ok Err Vec String Option Result
const var function this new typeof undefined null console log => === !==
{ } ( ) [ ] ; : , . -> :: == != <= >= += -= *= /= && || ++ -- << >> ** //
__init__ __name__ __main__ args kwargs config model_path max_tokens top_p top_k
""".split()

PUNCTUATION = list(".,;:!?'\"()[]{}<>-_/\\|@#$%^&*+=~`")

# Non-Latin pieces so multi-byte UTF-8 gets merges of its own, not only raw bytes.
CJK_AND_OTHER = """
你好 世界 谢谢 模型 服务器 请求 中文 日本語 こんにちは ありがとう 東京 猫 犬 안녕하세요 한국어
Привет мир спасибо Γειά σου κόσμε مرحبا שלום नमस्ते café naïve résumé façade jalapeño Ångström
straße über Zürich déjà vu coöperate piñata smörgåsbord
""".split()

EMOJI = list("😀😂🙂😉😍🤔👍👋🎉🔥✨🚀🌍🌧☕🍎🐍🦀💡📦✅❌⚠️❤️")


def _number(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return str(rng.randrange(10))
    if kind == 1:
        return str(rng.randrange(1000))
    if kind == 2:
        return f"{rng.randrange(100)}.{rng.randrange(100):02d}"
    return str(rng.randrange(10**9))


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(ENGLISH_WORDS) for _ in range(3 + rng.randrange(12))]
    if rng.randrange(3) == 0:
        words[0] = words[0].capitalize()
    if rng.randrange(4) == 0:
        words.insert(rng.randrange(len(words)), _number(rng))
    if rng.randrange(5) == 0:
        words.insert(rng.randrange(len(words)), rng.choice(CJK_AND_OTHER))
    if rng.randrange(6) == 0:
        words.append(rng.choice(EMOJI))
    return " ".join(words) + rng.choice([".", ".", ".", "?", "!", ",", ":"])


def _code_line(rng: random.Random) -> str:
    indent = "    " * rng.randrange(3)
    parts = [rng.choice(CODE_TOKENS) for _ in range(2 + rng.randrange(8))]
    if rng.randrange(2) == 0:
        parts.append(f"{rng.choice(ENGLISH_WORDS)}_{rng.choice(ENGLISH_WORDS)}")
    if rng.randrange(3) == 0:
        parts.append(rng.choice(PUNCTUATION) + _number(rng))
    return indent + " ".join(parts)


def make_corpus(seed: int = 0, num_lines: int = 6000) -> list[str]:
    """Deterministic training lines: prose, code, numbers, a little CJK and emoji."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        kind = rng.randrange(10)
        if kind < 6:
            lines.append(_sentence(rng))
        elif kind < 9:
            lines.append(_code_line(rng))
        else:
            lines.append(" ".join(rng.choice(CJK_AND_OTHER + EMOJI) for _ in range(4)))
    # Every word once more (alone, after a space, capitalized) so common words end up as single tokens.
    lines.extend(ENGLISH_WORDS)
    lines.extend(" " + w for w in ENGLISH_WORDS)
    lines.extend(" " + w.capitalize() for w in ENGLISH_WORDS)
    lines.extend(CODE_TOKENS + CJK_AND_OTHER)
    return lines
