"""``decode="fast"``: exllamav3's decode step behind one seam.

:mod:`.seam` installs and removes every wrap of a generator as one unit (what it relies on: :mod:`.requirements`,
checked with :mod:`..upstream.depends`; exllamav3's names from :mod:`..upstream`, the backend's one boundary). The
features see each wrapped call as a typed value (:mod:`.step`: a forward with its rows, positions and block table, a
page copy) and exllamav3's objects through the seam's views: the batched sampler (:mod:`.sampler`), the captured
step (:mod:`.graphs`), running ahead (:mod:`.run_ahead`), batched prefill (:mod:`.prefill`) and
``deterministic=True``'s rules (:mod:`.deterministic`). :mod:`.decode` puts them together.
"""

from .decode import FastDecode

__all__ = ["FastDecode"]
