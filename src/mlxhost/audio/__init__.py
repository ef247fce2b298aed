"""Audio models: Whisper speech-to-text and Kokoro text-to-speech, each on its own engine thread.

The HTTP side is frontends/audio/ (imports no MLX); this package loads the models and runs the jobs that
the handlers hand to the engine thread (`AsyncEngine.call`), one window or one sentence per call.
"""
