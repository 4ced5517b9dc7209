"""`tandem.engine.v1`: EngineCoreService (engine_core.proto) and its generated code."""
