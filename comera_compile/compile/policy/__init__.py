"""When and what to compile: the measured race of compiled against eager steps
(``measured``, bounded by ``step_bound``), the model's repeated blocks as one graph
(``blocks``), and rank bonds kept symbolic so rank cuts compile nothing (``rank_dims``)."""
