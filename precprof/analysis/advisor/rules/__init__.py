"""The advisor's rules, one module per theme; each adds findings to the plan."""
