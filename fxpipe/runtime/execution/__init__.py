"""Running stages: the stages a process holds, the local and the distributed executor, one stage
forward, the split backward, mixed precision, devices, the NaN/Inf check, kept memory, how a loss
splits over micro-batches."""
