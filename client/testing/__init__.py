"""Test and benchmark support: start a real kvtierd in a subprocess (``DaemonProcess``)."""
