"""The golden conformance suite: which invariance levels a backend reaches, op by op.

Modules:
  inputs   -- counter-based input generator (identical on every platform and library version)
  bits     -- exact bit comparison and the first divergence
  suite    -- the Case / Suite protocol each conformance suite implements (suites/: one module per suite)
  golden   -- golden files written from the reference backend, verified by SHA-256 on load
  runner   -- runs suites x backends x levels, builds the report (table, JSON, JUnit)
"""
