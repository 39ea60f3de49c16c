"""
Opt-in suites driving a real browser (Debian's headless chromium) against
the status page: C{tox -e browser}.
"""
