"""Communication: hybrid meshes, collectives that fail or stall, ranks that disagree or fall out
of step."""
