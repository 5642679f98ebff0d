"""fp8-parity's shipped property suite, installed as the package parity.property_suite (pyproject.toml's
package-dir): `pytest --fp8-impl X` and `fp8-parity test` run its test_properties.py in any repository."""
