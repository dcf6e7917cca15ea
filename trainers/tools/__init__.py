"""The user-facing tools around the library: the `trainers` command, the memory planner, run reports, the config
reference, tiny offline models and the environment report. They import the library; the library never imports
them."""
