"""Graph passes, one per module; each states what node metadata it reads and writes."""
