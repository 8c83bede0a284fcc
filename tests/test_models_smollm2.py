"""The default model's stored tensors do not move when other architectures are supported: the
full version and the 0.25 / 0.083 defaults of a short document hash to what the code before
the model adapter wrote (torch 2.13 CPU, this repository's pinned environment)."""

from __future__ import annotations

import hashlib

import torch

from conftest import run_cli

TEXT = "# Depot handbook\n\nThe Northgate depot opens at 6:40 on weekdays and at 8:15 on Saturdays. It stays closed on Sundays and on public holidays.\nDeliveries arrive at bay 7; the loading crew signs for them with the code 4471 and files the receipt in the blue cabinet.\n\n## Safety\n\nEvery visitor wears a yellow vest and signs the register at the gate. Forklifts have right of way in aisles C to F.\nThe emergency assembly point is the car park behind the canteen, next to the old water tower.\nFire drills happen on the first Monday of each quarter at 10:30.\n\n## Contacts\n\nThe shift supervisor this season is Marta Okonkwo (extension 218). Maintenance requests go to Piet Van Dam, extension 305,\nwho keeps the spare keys for the compressor room. Invoices older than 90 days are archived in building B, shelf 12.\n\n## Returns\n\nDamaged pallets are set aside in zone R and photographed before noon. A return slip needs the original order number,\nthe carrier's name and the date of arrival. Refunds are processed within 14 working days; credit notes are sent by email.\n"

PINNED = {
    "full": "a574e790389a73abae45c0c2648dbfb9acf0995f17293a4085cdc2f09815e3a6",
    "b0.25": "3fc068cffad25c32bf88dcd7ef602adc28a0812596dc7659ec43a16f8547a822",
    "b0.083": "b5f5b35188cd57f62f61a3727ebfa135cf26fd63a4e62f22740b88fb16d41f0c",
}


def tensors_digest(store, version) -> str:
    from kdnctl.bundle import decode_bundle

    h = hashlib.sha256()
    for c in version.chunks:
        b = decode_bundle(store.read_object(c.object))
        for name in sorted(b.tensors):
            t = b.tensors[name].contiguous()
            h.update(name.encode())
            h.update(str(t.dtype).encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_default_model_tensors_unchanged(tmp_path):
    from kdnctl.store import Store

    doc = tmp_path / "pin.md"
    doc.write_text(TEXT)
    store = tmp_path / "s"
    run_cli("ingest", doc, store=store, check=True)
    for budget in ("0.25", "0.083"):
        run_cli("compress", "pin.md", "--budget", budget, store=store, check=True)
    st = Store(store, create=False)
    got = {}
    for v in st.list_versions("pin.md"):
        key = "full" if v.label == "full" else next(k for k in PINNED if k != "full" and k in v.label)
        got[key] = tensors_digest(st, v)
    assert got == PINNED
