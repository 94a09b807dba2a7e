"""Small helpers any layer may use: numbers as text, files written atomically."""
