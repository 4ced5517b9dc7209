"""`tandem.engine`: the internal contract between frontends and engines."""
