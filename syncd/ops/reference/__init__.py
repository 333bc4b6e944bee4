"""Plain NumPy/Python reference implementations: the executable specification every backend is tested
against. Correct and slow; never picked by ``backend="auto"`` when another backend can run."""
