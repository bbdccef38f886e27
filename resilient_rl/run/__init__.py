"""The run folder as a format: layout, metrics and events, the controller record, the log."""
