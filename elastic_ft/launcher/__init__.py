"""The node side's launcher: ``ftrun`` (see :mod:`elastic_ft.launcher.ftrun`)."""
