# cacheproxy: the proxy image (the runner runs mlx_lm.server from the same image, or natively).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY cacheproxy ./cacheproxy
COPY backends ./backends
COPY policies ./policies
RUN pip install --no-cache-dir .
EXPOSE 8080
ENTRYPOINT ["cacheproxy"]
CMD ["serve", "--host", "0.0.0.0"]
