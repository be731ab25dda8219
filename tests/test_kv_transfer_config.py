"""vLLM's ``kv_transfer_config``, checked where the configuration is made: its connector, its role and its
folder; every other value is a ValueError before anything runs."""

import pytest

from minipaged.common.config import EngineConfig, KVTransferConfig
from minipaged.common.stats import KVTransferStats

pytestmark = pytest.mark.common


def test_a_dict_becomes_the_config_with_its_defaults():
    """The folder is vLLM's default; the connector and the role are minipaged's (vLLM's are None)."""
    config = EngineConfig(kv_transfer_config={"kv_role": "kv_consumer"}).kv_transfer_config
    assert config == KVTransferConfig("SharedStorageConnector", "kv_consumer", {})
    assert config.shared_storage_path == "/tmp"  # vLLM's SharedStorageConnector's default folder
    assert (config.is_kv_producer, config.is_kv_consumer) == (False, True)
    assert (KVTransferConfig(kv_role="kv_producer").is_kv_producer, KVTransferConfig().is_kv_consumer) == (True, True)


@pytest.mark.parametrize("value", [
    "SharedStorageConnector",  # not a dict
    {"kv_connector": "NixlConnector"},  # a connector not built here
    {"kv_role": "kv_prefill"},
    {"kv_rank": 0},  # an unknown key
    {"kv_connector_extra_config": {"shared_storage_path": 3}},
    {"kv_connector_extra_config": {"storage": "x"}},
    {"kv_connector_extra_config": "x"},
])
def test_a_bad_kv_transfer_config_is_refused(value):
    with pytest.raises(ValueError):
        EngineConfig(kv_transfer_config=value)


def test_the_two_sides_counts_add_up():
    a = KVTransferStats(num_external_tokens=8, num_recomputed_tokens=4)
    b = KVTransferStats(num_loaded_blocks=2, num_loaded_bytes=100, num_failed_blocks=1)
    assert a + b == KVTransferStats(8, 4, 2, 100, 1, 0, 0)
