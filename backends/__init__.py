"""Backends: each implements the op specs for a kind of device.

* ``reference`` -- the readable definition of every strict spec, on CPU (golden bits come from it).
* ``stock``     -- torch's own ops, ignoring the spec: the negative control of the conformance suite.

Third-party backends register through the ``lockstep.backends`` entry-point group (see README).
"""
