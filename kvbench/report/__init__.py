"""Layer 7, the report: run, sweep and what-if directories loaded and grouped into comparable sections
(data), settings in words (words), charts (charts), one offline HTML file (html)."""
from kvbench.report.html import Report, build_report

__all__ = ["Report", "build_report"]
