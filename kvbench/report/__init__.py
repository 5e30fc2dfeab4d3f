"""Layer 7, the report: run and sweep directories loaded (data), charts (charts), one offline HTML
file (html)."""
