"""Graph rewrites the ``comera`` backend applies on every device: attention through the rank
bonds (``absorbed_attention``), thin sibling products joined (``sibling_matmuls``), what a
low memory budget recomputes and keeps (``recompute``), and the node helper they share
(``graph_nodes``)."""
