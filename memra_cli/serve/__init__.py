"""`memra serve`: the OpenAI-compatible HTTP front end (app.py), its wire format (protocol.py) and the one
thread that runs every model computation (worker.py)."""
