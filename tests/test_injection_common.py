# SPDX-License-Identifier: Apache-2.0
"""injection_common.py's shared helpers: how an injection reports what it did."""


def test_report_prints_a_warning_once(capsys, monkeypatch):
    """Where logging is not configured, Python's last-resort handler prints a WARNING to stderr: report does not
    print it a second time; an INFO line (never shown by that handler) is printed where verbose."""
    import logging

    import injection_common as ic

    log = logging.getLogger("report_test_unconfigured")
    monkeypatch.setattr(log, "hasHandlers", lambda: False)
    monkeypatch.setattr(log, "propagate", False)
    ic.report(log, "warned", True, warning=True)
    ic.report(log, "informed", True)
    err = capsys.readouterr().err
    assert err.count("warned") == 1 and err.count("informed") == 1
    ic.report(log, "quiet", False)
    assert "quiet" not in capsys.readouterr().err
