"""Planning a step, pure: schedules, the one clock that plays them, the point-to-point plan, a
step simulated with real durations, timelines."""
