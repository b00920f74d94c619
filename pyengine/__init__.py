"""pyengine: an LLM inference engine core (placeholder until the native module lands)."""
