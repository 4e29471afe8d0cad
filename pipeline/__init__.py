"""Pipeline parallelism: stage splitting, point-to-point, schedules and their executor."""
