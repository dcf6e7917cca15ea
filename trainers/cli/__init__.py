"""The command line and what a person runs around the library: the `trainers` command, the memory planner, run
reports, the config reference, tiny offline models and the environment report (tool calling is trainers/agents/).
They import the library; the library never imports them."""
