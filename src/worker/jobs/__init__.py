"""A job's input, how its stream is batched, and its deadlines."""
