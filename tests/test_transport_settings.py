"""Transport security settings: read from the environment or a secrets folder, turned into the same aiokafka and
Faust options for every Kafka client, and never shown in a repr or a log line."""

from __future__ import annotations

import ssl
from pathlib import Path

import faust
import pytest
import structlog
from pydantic import SecretStr

from memstream.runtime import settings_env
from services.settings import Settings
from streams.app import faust_credentials, faust_options
from streams.kafka_security import KafkaSecurityError, describe, kafka_client_options

SECRET = "s3cret-Value-that-must-not-leak"


def secured(**overrides: object) -> Settings:
    values: dict[str, object] = {
        "kafka_security_protocol": "SASL_PLAINTEXT",
        "kafka_username": "memstream",
        "kafka_password": SECRET,
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[arg-type]


def test_secrets_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMSTREAM_KAFKA_SECURITY_PROTOCOL", "SASL_SSL")
    monkeypatch.setenv("MEMSTREAM_KAFKA_PASSWORD", SECRET)
    monkeypatch.setenv("MEMSTREAM_WEAVIATE_API_KEY", "wkey")
    monkeypatch.delenv("MEMSTREAM_SECRETS_DIR", raising=False)
    settings = Settings(_env_file=None)
    assert settings.kafka_security_protocol == "SASL_SSL"
    assert isinstance(settings.kafka_password, SecretStr)
    assert settings.kafka_password.get_secret_value() == SECRET
    assert settings.weaviate_api_key is not None and settings.weaviate_api_key.get_secret_value() == "wkey"


def test_secrets_come_from_files_in_the_secrets_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "memstream_kafka_password").write_text(SECRET + "\n")
    (tmp_path / "memstream_dgraph_password").write_text("dpass")
    (tmp_path / "memstream_dgraph_token").write_text("dtoken")
    (tmp_path / "memstream_weaviate_api_key").write_text("wkey")
    monkeypatch.setenv("MEMSTREAM_SECRETS_DIR", str(tmp_path))
    monkeypatch.delenv("MEMSTREAM_KAFKA_PASSWORD", raising=False)
    settings = Settings(_env_file=None)
    assert settings.kafka_password is not None and settings.kafka_password.get_secret_value() == SECRET
    assert settings.dgraph_password is not None and settings.dgraph_password.get_secret_value() == "dpass"
    assert settings.dgraph_token is not None and settings.dgraph_token.get_secret_value() == "dtoken"
    assert settings.weaviate_api_key is not None and settings.weaviate_api_key.get_secret_value() == "wkey"


def test_the_environment_wins_over_a_secret_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "memstream_kafka_password").write_text("from-file")
    monkeypatch.setenv("MEMSTREAM_SECRETS_DIR", str(tmp_path))
    monkeypatch.setenv("MEMSTREAM_KAFKA_PASSWORD", "from-env")
    settings = Settings(_env_file=None)
    assert settings.kafka_password is not None and settings.kafka_password.get_secret_value() == "from-env"


def test_no_secrets_folder_reads_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MEMSTREAM_SECRETS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    settings = Settings(_env_file=None)
    assert settings.kafka_password is None and settings.weaviate_api_key is None


def test_plaintext_adds_no_client_options() -> None:
    assert kafka_client_options(Settings(_env_file=None, kafka_security_protocol="PLAINTEXT")) == {}
    assert faust_credentials(Settings(_env_file=None)) is None


def test_sasl_options_for_every_aiokafka_client() -> None:
    options = kafka_client_options(secured(kafka_sasl_mechanism="SCRAM-SHA-512"))
    assert options == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "memstream",
        "sasl_plain_password": SECRET,
    }


def test_sasl_ssl_and_mtls_options_carry_an_ssl_context(tmp_path: Path) -> None:
    options = kafka_client_options(secured(kafka_security_protocol="SASL_SSL"))
    assert options["security_protocol"] == "SASL_SSL"
    assert isinstance(options["ssl_context"], ssl.SSLContext)
    assert options["ssl_context"].verify_mode == ssl.CERT_REQUIRED
    only_tls = kafka_client_options(Settings(_env_file=None, kafka_security_protocol="SSL"))
    assert set(only_tls) == {"security_protocol", "ssl_context"}
    with pytest.raises(KafkaSecurityError, match="go together"):
        kafka_client_options(
            Settings(_env_file=None, kafka_security_protocol="SSL", kafka_ssl_certfile=tmp_path / "client.pem")
        )


def test_a_sasl_protocol_without_credentials_is_refused() -> None:
    with pytest.raises(KafkaSecurityError, match="MEMSTREAM_KAFKA_USERNAME"):
        kafka_client_options(Settings(_env_file=None, kafka_security_protocol="SASL_PLAINTEXT"))


def test_faust_gets_the_same_credentials() -> None:
    credentials = faust_credentials(secured())
    assert isinstance(credentials, faust.SASLCredentials)
    assert (credentials.username, credentials.password) == ("memstream", SECRET)
    assert credentials.mechanism.value == "SCRAM-SHA-256"
    app = faust.App("transport-test", **faust_options(secured(), "127.0.0.1:9092"))
    assert isinstance(app.conf.broker_credentials, faust.SASLCredentials)
    assert app.conf.broker_credentials.username == "memstream"
    tls = faust_credentials(Settings(_env_file=None, kafka_security_protocol="SSL"))
    assert isinstance(tls, faust.SSLCredentials)


def test_secrets_never_show_in_reprs_or_logs(capsys: pytest.CaptureFixture[str]) -> None:
    settings = secured(dgraph_password="dg-" + SECRET, weaviate_api_key="wv-" + SECRET, dgraph_token="tk-" + SECRET)
    assert SECRET not in repr(settings)
    assert SECRET not in str(settings.model_dump())
    assert SECRET not in repr(faust_credentials(settings))
    structlog.get_logger("test").info("kafka_security", **describe(settings), settings=settings)
    assert SECRET not in capsys.readouterr().out
    assert describe(settings) == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-256",
        "username": "memstream",
    }


def test_child_processes_get_the_secret_itself() -> None:
    """``memstream up`` hands its settings to the gateway and workers as variables: the secret, not its mask."""
    env = settings_env(secured(weaviate_api_key="wkey"))
    assert env["MEMSTREAM_KAFKA_PASSWORD"] == SECRET
    assert env["MEMSTREAM_WEAVIATE_API_KEY"] == "wkey"
