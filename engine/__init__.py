"""Engine adapters: the protocol an inference engine implements to take weight updates."""
