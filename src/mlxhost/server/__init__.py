"""The serving process: command line, settings and configs, wiring (app.py), the model manager."""
