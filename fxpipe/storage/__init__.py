"""State and storage: the tensors' state_dict names and structure, checkpoints and resuming,
weights, atomic files, the save lock, the user's files in a program folder."""
