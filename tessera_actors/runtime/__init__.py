"""The actor runtime (torch-free): actors, the system, wire messages, errors."""
