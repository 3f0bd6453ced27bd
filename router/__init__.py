"""kvpilot router: prefix- and load-aware routing across the daemons of one InferenceDeployment."""
