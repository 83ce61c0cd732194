"""Glue to the outside world: command line, Trainer callback, Accelerate."""
