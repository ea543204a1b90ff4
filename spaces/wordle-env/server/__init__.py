"""Server side of the Wordle Space: environment, configuration, message guard and ASGI app."""
