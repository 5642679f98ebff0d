"""heldout14: a frozen held-out set of FP8 linear implementations (8 correct, 52 planted bugs).

See README.md; ``manifest.json`` labels every file, ``twins.json`` maps each bug to its
correct twin, ``verify.py`` re-checks the labels on CPU.  Nothing here imports the harness.
"""
