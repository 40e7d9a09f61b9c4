"""The memory planner."""
