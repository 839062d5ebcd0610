"""Studies: the library functions the commands and the ledger call to measure something across
the stack (a kernel sweep, a tile search, a plan, a scaling run, the step against a bare one).
Each returns numbers or records; tables and plots are lab/report's, command lines lab/tools'.
"""
