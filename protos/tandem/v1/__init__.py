"""`tandem.v1`: the public GenerationService (generation.proto) and its generated code."""
