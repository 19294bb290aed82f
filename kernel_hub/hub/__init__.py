"""Versioned kernel builds on the Hugging Face Hub.

* :mod:`.build` turns ``kernels/<name>`` into ``build/<variant>/`` folders (kernel-hub's loader
  and, for ``torch-*`` variants, Hugging Face ``kernels`` load them); :mod:`.metadata`,
  :mod:`.digests`.
* :mod:`.publish` uploads a build as tag ``vX.Y.Z`` and moves branch ``vX``; re-publishing a
  version is refused.
* :mod:`.fetch` resolves a version range / branch / commit over the repo's refs, downloads only the
  variant for this machine (:mod:`.transfer`: kernel-hub's own bounded downloads into a private
  staging folder, no server value ever naming a path; :mod:`.network`: timeouts, capped retries,
  size caps and the fetch deadline of every request), verifies it, and only then moves it into
  the cache; :mod:`.cache` answers the same questions offline.
* :mod:`.index`: the publisher's signed, expiring index of versions and commits (freshness,
  rollback and relabel protection, revocation of a stolen key; ``kernel-hub index refresh /
  revoke``); :mod:`.recovery`: which listed builds an index keeps once a key is revoked.
* :mod:`.lockfile` / :mod:`.locking`: ``kernel-hub.lock`` pins commits and every file's digest.
* :mod:`.trust`: downloaded code is imported only from allowlisted publishers.
* :mod:`.signing`: ed25519 signatures over each variant's metadata.json (``kernel-hub keygen``,
  ``publish --sign-key``), verified against keys pinned in the registry before anything is
  imported (docs/trust.md).
* :mod:`.store` / :mod:`.server` / :mod:`.mirror`: a directory of hub repos,
  ``kernel-hub serve`` (the Hub's HTTP API over it) and ``kernel-hub mirror`` (verified copies).
* :mod:`.json_source`: JSON files read so that any input fails as a ``SourceError``.

``get_kernel`` (:mod:`kernel_hub.loading.resolver`) decides between the in-tree kernel and a hub
build.

Environment (read at call time, see :mod:`.settings`):

==============================  ==========================================================
``HF_ENDPOINT``                 hub to talk to (default https://huggingface.co)
``HF_HUB_CACHE`` / ``HF_HOME``  Hugging Face cache where builds are downloaded
``HF_HUB_OFFLINE=1``            resolve from the cache only, no network call
``KERNEL_HUB_SOURCE``           ``local`` (in-tree) or ``hub``: default source for get_kernel
``KERNEL_HUB_LOCAL_KERNELS``    ``op=/path,...``: load these ops from a directory (development)
``KERNEL_HUB_LOCK``             lock file to honour (default ``./kernel-hub.lock`` if present)
``KERNEL_HUB_TRUSTED_PUBLISHERS``  comma-separated orgs whose code may be imported (``kernel-hub``)
``KERNEL_HUB_VARIANT``          force a build variant (``torch-cpu``, ``torch-tpu``)
``HF_HUB_DOWNLOAD_TIMEOUT``     connect/read timeout of file downloads (10 s)
``HF_HUB_ETAG_TIMEOUT``         connect/read timeout of API answers (10 s)
``KERNEL_HUB_FETCH_DEADLINE``   one whole fetch, lock waits included (900 s)
``KERNEL_HUB_RETRY_TIME``       all waits between retries of one fetch (60 s)
``KERNEL_HUB_MAX_RETRY_AFTER``  longest ``Retry-After`` honoured (30 s)
``KERNEL_HUB_MAX_PAGES``        listing pages followed (100)
``KERNEL_HUB_MAX_API_BYTES``    decoded bytes of one API answer (16 MiB)
``KERNEL_HUB_STATE_DIR``        what this user accepted of signed indexes: revocations and
                                serials (default ``$XDG_STATE_HOME/kernel-hub``, else
                                ``~/.local/state/kernel-hub``; outside the shared cache)
==============================  ==========================================================
"""
