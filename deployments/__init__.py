"""Ray Serve layer of mmserve: thin deployments that move `mmserve.messages` between processes."""
