"""Model I/O: loading and saving models, external data, export of trained values, inspect (internal)."""
