"""`mlxhost serve` settings from three places, strongest first: command-line flags, `MLXHOST_<FLAG>`
environment variables (`MLXHOST_PORT=9000`, `MLXHOST_MAX_NUM_SEQS=8`), a YAML file (`--config FILE`,
keys are flag names with dashes or underscores). Built-in defaults come last.

They become the parser's defaults before the command line is parsed, so argparse keeps its usual
rules (a flag given overrides them) and a value is checked by the same type and choices as a flag.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from pathlib import Path

import yaml

from mlxhost.config import parse_memory
from mlxhost.server.foreign_flags import FOREIGN, refusal

ENV_PREFIX = "MLXHOST_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, unless its help already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        said = any(s in text for s in ("default:", "(default", "default off", "%(default)"))
        if said or action.default is argparse.SUPPRESS or not action.option_strings or action.required:
            return text
        if action.default in (None, [], ""):
            return text + " (default: none)"
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            return text + " (default: not set)"  # a switch: "off" would read as the feature's state
        if isinstance(action.default, (list, tuple)):  # as typed on the command line: 1,2,4
            return text + " (default: %s)" % ",".join(map(str, action.default)).replace("%", "%%")
        return text + " (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """Errors as one line that names the flag first, then where the flags are listed: serve's usage alone is
    forty lines, and the error under it went unread. No abbreviations: a prefix (`--max-num-seq`) would be
    taken silently for a flag, and a later flag sharing that prefix would change what it means."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def _check_value(self, action: argparse.Action, value) -> None:
        # argparse's only hook for a bad choice; a mistyped command gets the closest one.
        if isinstance(action, argparse._SubParsersAction) and value not in action.choices:
            close = difflib.get_close_matches(value, list(action.choices), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "the commands: " + ", ".join(action.choices)
            self.exit(2, f"{self.prog}: error: unknown command {value!r}; {hint}\n"
                         f"(`{self.prog} --help` lists the commands)\n")
        super()._check_value(action, value)

    def error(self, message: str):
        message = re.sub(r"^argument ([^:]+): ", r"\1: ", message)
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists every flag)\n")


def size(text: str) -> str:
    """type= of the size flags: the text as given (a percentage needs the machine's RAM, read later), once it
    reads as a size."""
    try:
        ok = parse_memory(text, 1 << 40) >= 0
    except (ValueError, OverflowError):
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"could not read {text!r} as a size (e.g. 2GB, 512MiB, 20%)")
    return text


def fraction(text: str) -> float:
    """type= of a share of memory: above 0, at most 1."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share above 0 and at most 1 (e.g. 0.9), got {text!r}")
    return value


def env_name(action: argparse.Action) -> str:
    """MLXHOST_MAX_NUM_SEQS for --max-num-seqs; MLXHOST_MODEL for the MODEL argument."""
    flag = next((o for o in action.option_strings if o.startswith("--")), None)
    return ENV_PREFIX + (flag[2:] if flag else action.dest).upper().replace("-", "_")


def _settable(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Setting name (dashes as underscores) -> action. The positional MODEL and the repeatable
    --model share the name `model`: one value names MODEL, several are --model entries."""
    out = {}
    for action in parser._actions:  # argparse has no public list of a parser's actions
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)) or action.dest == "config":
            continue
        key = env_name(action)[len(ENV_PREFIX):].lower()
        if key in out:  # --model after MODEL: keep both under distinct keys
            key = "+" + key
        out[key] = action
    return out


def _convert(action: argparse.Action, raw, where: str):
    """A value from the environment (a string) or YAML (any scalar or a list) as the flag would give it."""
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if isinstance(raw, bool):
            value = raw
        elif str(raw).strip().lower() in _TRUE | _FALSE:
            value = str(raw).strip().lower() in _TRUE
        else:
            raise ValueError(f"{where}: expected true or false, got {raw!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(action, argparse._AppendAction):
        items = raw if isinstance(raw, list) else [p for p in str(raw).split(",") if p.strip()]
        return [_one(action, item, where) for item in items]
    if isinstance(raw, (list, dict)):
        raise ValueError(f"{where}: expected one value, got {raw!r}")
    return _one(action, raw, where)


def _one(action: argparse.Action, raw, where: str):
    if isinstance(raw, bool) and action.choices is not None and {"on", "off"} <= set(action.choices):
        raw = "on" if raw else "off"  # YAML 1.1 reads a bare on / off as a boolean
    text = str(raw).strip()
    try:
        value = action.type(text) if action.type is not None else text
    except argparse.ArgumentTypeError as exc:  # our converters' messages quote the value already
        raise ValueError(f"{where}: {exc}") from None
    except (TypeError, ValueError):
        kind = {int: "a whole number", float: "a number"}.get(action.type, "a valid value")
        raise ValueError(f"{where}: expected {kind}, got {raw!r}") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ValueError(f"{where}: {raw!r} is not one of {choices}")
    return value


def _model_setting(actions: dict, raw, where: str) -> dict:
    # `model: PATH` names the one model; a list (or MLXHOST_MODEL=a,b) serves several, as --model does.
    items = raw if isinstance(raw, list) else [p for p in str(raw).split(",") if p.strip()]
    if len(items) == 1 and "=" not in str(items[0]):
        return {actions["model"].dest: str(items[0]).strip()}
    return {actions["+model"].dest: _convert(actions["+model"], items, where)}


def read_config_file(path: str | Path) -> dict:
    path = Path(path).expanduser()
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    return data


def settings_defaults(parser: argparse.ArgumentParser, config_file: str | None,
                      environ: os._Environ | dict | None = None, notes: list | None = None) -> dict:
    """Defaults for `parser` from the config file, then the environment over it; ValueError names the
    unknown key or bad value. `notes` gets a line per key another server's config names (for the log)."""
    environ = os.environ if environ is None else environ
    actions = _settable(parser)
    defaults: dict = {}
    sources = []
    if config_file:
        sources += [(str(k).replace("-", "_").lower(), v, f"--config {config_file}: {k}")
                    for k, v in read_config_file(config_file).items()]
    sources += [(name[len(ENV_PREFIX):].lower(), value, name) for name, value in environ.items()
                if name.startswith(ENV_PREFIX) and name[len(ENV_PREFIX):].lower() in actions]
    given = {key for key, _, _ in sources}
    for key, raw, where in sources:
        if key == "model" and "+model" in actions:
            defaults.update(_model_setting(actions, raw, where))
            continue
        action = actions.get(key)
        if action is None:
            key, implied = _foreign_key(key, where, actions, notes if notes is not None else [])
            if key is None:
                continue
            action = actions[key]
            for other, value in implied.items():
                if other not in given:
                    defaults[actions[other].dest] = _convert(actions[other], value, where)
        defaults[action.dest] = _convert(action, raw, where)
    return defaults


def _foreign_key(key: str, where: str, actions: dict, notes: list) -> tuple[str | None, dict]:
    """A key another server's config uses (vLLM's gpu_memory_utilization): ours and the keys it implies, None
    for one that is ignored; ValueError for one with no same meaning here or no such key at all."""
    flag = "--" + key.replace("_", "-")
    foreign = FOREIGN.get(flag)
    if foreign is None:
        close = difflib.get_close_matches(key, sorted(k for k in actions if not k.startswith("+")), n=1)
        raise ValueError(f"{where}: no such setting" + (f" (did you mean {close[0]}?)" if close else
                                                       "; `mlxhost serve --help` lists them (dashes as underscores)"))
    if foreign.ours is None:
        raise ValueError(f"{where}: {refusal(flag)}")
    if not foreign.ours:
        notes.append(f"{where} ({foreign.origin}) is ignored: {foreign.note}")
        return None, {}
    ours = foreign.ours[2:].replace("-", "_")
    notes.append(f"{where} is {foreign.origin}'s name for {ours}")
    return ours, {flag[2:].replace("-", "_"): value for flag, value in foreign.also.items()}
