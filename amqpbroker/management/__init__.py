"""Operations: the management REST API and console, metrics, the idle-expiry policy
and the admin CLI (docs/operations.md).  Importing this package is cheap: the web
stack is imported only when the management listener starts."""
