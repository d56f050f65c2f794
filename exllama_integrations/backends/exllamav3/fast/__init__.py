"""``decode="fast"``: exllamav3's decode step behind one seam.

:mod:`.seam` is the only module that touches exllamav3's internals (what it relies on: :mod:`.requirements`, checked
with :mod:`.depends`); the features see the step through it: the batched sampler (:mod:`.sampler`), the captured
step (:mod:`.graphs`), running ahead (:mod:`.run_ahead`) and batched prefill (:mod:`.prefill`). :mod:`.decode`
puts them together.
"""

from .decode import FastDecode

__all__ = ["FastDecode"]
