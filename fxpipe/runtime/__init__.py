"""Runtime: the schedule, communication, and the executors that run generated stage code."""
