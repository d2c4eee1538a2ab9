"""A secured cluster (docs/security.md): the roles and what each may do (``roles``), the CA and certificates
(``pki``), and the credentials a secured embedded stack generates under its state dir (``material``)."""
