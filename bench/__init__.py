"""agentd's benchmarks: ``python -m bench [--quick|--full]`` (see bench/__main__.py)."""
