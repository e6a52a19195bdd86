"""`GrpcSecurity`: where the token comes from, what its repr shows, what it refuses."""
from __future__ import annotations

import pickle

import pytest

from services.common.grpc_security import TOKEN_ENV, TOKEN_FILE_ENV, GrpcSecurity


def test_token_sources_in_order(tmp_path):
    file = tmp_path / "token"
    file.write_text("from-file\n")
    other = tmp_path / "other"
    other.write_text("from-env-file")
    assert GrpcSecurity.load(str(file), env={TOKEN_ENV: "from-env"}).token == "from-file"
    assert GrpcSecurity.load(env={TOKEN_ENV: "from-env"}).token == "from-env"
    assert GrpcSecurity.load(env={TOKEN_FILE_ENV: str(other)}).token == "from-env-file"
    assert GrpcSecurity.load(env={}).token is None
    made = GrpcSecurity.load(env={}, generate=True).token
    assert made and made != GrpcSecurity.load(env={}, generate=True).token


def test_repr_and_errors_never_show_the_token(tmp_path):
    security = GrpcSecurity(token="hunter2-token")
    assert "hunter2" not in repr(security) and "hunter2" not in str(security)
    assert pickle.loads(pickle.dumps(security)) == security      # travels to Ray actors
    with pytest.raises(ValueError) as err:
        GrpcSecurity(token="bad token\n")
    assert "bad token" not in str(err.value)
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        GrpcSecurity.load(str(tmp_path / "empty"), env={})
    with pytest.raises(OSError):
        GrpcSecurity.load(str(tmp_path / "missing"), env={})


def test_tls_needs_certificate_key_and_ca_together():
    with pytest.raises(ValueError, match="together"):
        GrpcSecurity(cert_chain=b"cert", private_key=b"key")
    assert GrpcSecurity(cert_chain=b"c", private_key=b"k", root_ca=b"ca").tls
