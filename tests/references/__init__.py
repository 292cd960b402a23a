"""Float64 ports of the published attention code of each `pe_attention` method.

Each module follows one repository's own attention forward (its passes, masks, caches and position
handling) closely enough that a disagreement with `service.model.attention_rules` points at a real
difference, and says in its docstring which repository and file it was read from. They are test
oracles: written for this project from reading the authors' code, nothing imported from it.

Every port takes q, k, v of shape [heads, T, head_dim] before RoPE, in float64, and returns the
attention output [heads, T, head_dim] (no projections). The ones that have a decode path take
`prefill`: the first `prefill` tokens run as one pass, the rest one token at a time through the
authors' cached path, so the tests also check that generation equals scoring.
"""
