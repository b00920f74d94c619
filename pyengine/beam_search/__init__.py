"""Beam search above the engine, as vLLM's ``LLM.beam_search``: each step asks the engine
for one token and the top log-probabilities of every live beam (all beams of all prompts
in one batch), and the prefix cache shares the blocks beams have in common. See
docs/beam_search.md."""

from pyengine.beam_search.outputs import BeamSearchOutput, BeamSearchSequence
from pyengine.beam_search.params import BeamSearchParams

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence"]
