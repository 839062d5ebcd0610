"""Records → verdicts → REPORT.md and plots; several result folders merged side by side.

`claims` holds every claim of ../shared/CLAIMS.md with its stated range as data, `verdict`
judges a claim from records alone, `markdown` and `plots` render a results folder, `compare`
merges folders from several backends.
"""
